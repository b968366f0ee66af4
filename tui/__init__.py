"""The Textual front end of `localkv chat`. This folder is installed as `localkv.tui` (pyproject.toml
maps tui/ there), so it is imported as `localkv.tui...`, never as `tui`."""
