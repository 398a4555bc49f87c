"""What this machine allows a model: its memory bandwidth and matmul rates, measured (probe.py, `kvflow bench
probe`), and the bounds they set on decode and prefill (roofline.py).

Below the server, whose page shows a request's speed against these bounds, and below bench/, whose tools
report against them; above the executors (the probe times the packed kernel at the executors' thresholds).
"""
