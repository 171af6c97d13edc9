"""The ZeroMQ runtime: a driver, N controller processes, data between them (no zmq import here)."""

STARTUP_TIMEOUT_S = 120.0
"""How long a controller waits for the driver's SETUP, and a driver for its controllers."""
