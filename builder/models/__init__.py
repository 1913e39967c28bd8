"""Model weights: the content-addressed model store and `builder fetch`."""
