"""The driver's console: quiet libraries, one progress display for data preparation and training."""
