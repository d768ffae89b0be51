"""nn.Modules of the target models and draft heads, and the layers they share."""
