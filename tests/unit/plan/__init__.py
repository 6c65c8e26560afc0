"""Tests of stalwart.plan: closed forms, simulation, planner, inputs and the CLI."""
