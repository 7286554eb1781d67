"""tokenmill route: a gateway over N OpenAI-compatible workers.

Pure decisions (no I/O, no clock): snapshot.py (the contract), policies.py, admission.py, prefix_index.py.
Live state: worker_state.py, rates.py, queues.py, router.py. I/O: proxy.py, health.py, app.py, cli.py.
See docs/router.md.
"""
