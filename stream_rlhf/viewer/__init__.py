"""The per-sample viewer: `stream-rlhf view runs/<name> [--serve [--port P]]`.

`samples_file.py` reads the run's bounded sample log (samples.jsonl, `telemetry/sample_log.py`),
`page.py` writes runs/<name>/view.html (one self-contained page: `page.html`, `page.css` and
`page.js` inlined with the data; nothing is fetched from a network) and `serve.py` serves the
folder on 127.0.0.1.
"""
