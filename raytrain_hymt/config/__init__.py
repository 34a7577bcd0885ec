"""The typed configuration (pure): every field documented, validated and defaulted once; the presets; the
generated reference page."""
