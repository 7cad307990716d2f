"""tasks: see ARCHITECTURE.md."""
