"""``/v1/chat/completions``: its wire types, its planning and its answers."""
