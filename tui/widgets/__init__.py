"""The widgets of the chat screen, one module each, with their own look in DEFAULT_CSS; the screen's
layout (docks, widths, the narrow-terminal rules) stays in ../app.tcss."""
