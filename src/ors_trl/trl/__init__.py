"""trl: see ARCHITECTURE.md."""
