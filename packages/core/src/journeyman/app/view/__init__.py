"""The run viewer: `journeyman view` and the `/view/` pages of `journeyman serve` (a JSON API over
run directories, `api.py`; the pages, plain JavaScript and SVG shipped in `static/`)."""
