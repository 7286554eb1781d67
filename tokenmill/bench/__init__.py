"""`tokenmill bench`: goodput under SLOs against any OpenAI-compatible server.

Pipeline: a workload plans sessions of turns (`session.py`), an arrival process or a closed loop
schedules them (`arrivals.py`, `runner.py`), the streaming client measures each request
(`client.py` -> `record.py`), `metrics.py` reduces the records to a summary, `sweep.py` searches the
highest rate that meets the SLOs, and `report.py` writes result.json, summary.md and plots.
"""
