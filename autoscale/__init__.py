"""Autoscaling: custom/external metrics API adapter fed by worker load reports, and the scaling-policy simulator."""
