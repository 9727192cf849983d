"""Run health: alerts computed in the driver from each step's metrics (``alerts/*``)."""

from asyncrl.monitor.alerts import HealthMonitor
from asyncrl.monitor.settings import MonitorSettings

__all__ = ["HealthMonitor", "MonitorSettings"]
