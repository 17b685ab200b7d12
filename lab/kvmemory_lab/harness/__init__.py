"""Reliability harnesses run by ``kvmemory bench reliability`` and the tests: SIGKILL crash
safety of the checkpointer (``crash``) and concurrent LangGraph threads under a memory budget
(``concurrency``)."""
