"""Built-in components. Each module is a plugin registered through the same hooks as third-party ones."""
