"""Shared contracts of saoserve: records, settings, log transport, database models.

Server, learner and judge import this package and nothing else of each other (docs/design.md §3).
"""
