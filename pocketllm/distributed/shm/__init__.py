"""The shared-memory all-reduce for TP ranks that are CPU processes on one host: a C helper
(allreduce.c, built and loaded by build.py), its plain torch reference (reduce.py), the segment
the ranks share (segment.py) and the collective the engine calls (collective.py)."""
