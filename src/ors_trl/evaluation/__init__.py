"""evaluation: see ARCHITECTURE.md."""
