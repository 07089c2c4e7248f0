"""The scripts the tests start as processes (gloo ranks, launch agents'
workers): each run as ``__main__`` by tests_py/forked.py, importing the
tests' helpers from tests_py (on the path of every test process)."""
