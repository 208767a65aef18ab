"""Collectives for fp8blk (MPI, NCCL, torch process groups). See DESIGN §5."""
