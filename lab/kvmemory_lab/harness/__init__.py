"""Reliability harnesses run by ``kvmemory bench reliability`` and the tests: SIGKILL crash
safety of the checkpointer (``crash``) and concurrent LangGraph threads under a memory budget
(``concurrency``); LangGraph's own saver tests with every saver wrapped in the checkpointer
(``upstream_saver_tests``, by hand); a cluster of worker processes sharing threads through
PostgreSQL and Redis, with random routing and fault injection (``workers``, the scale-out
deployment pattern)."""
