"""moe_exp: measure what training optimizations do to a Mixture-of-Experts transformer."""
__version__ = "0.1.0"
