"""`python -m nvfp4_jax.maxtext <MaxText train arguments>`: the launcher.

A face: it only re-exports and runs `main`.
"""

from nvfp4_jax._src.integrations.maxtext import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
