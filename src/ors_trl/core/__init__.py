"""core: see ARCHITECTURE.md."""
