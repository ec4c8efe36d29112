"""Core lending (distributed/core_lease.py): a worker takes the lent threads only while its side holds a
real `CoreLease` actor; the lenders' threads are shared evenly."""

import ray
import torch

from posttrain.distributed.core_lease import GENERATOR, TRAINER, CoreLease, LeasedThreads, lent_threads


def test_a_worker_takes_the_lent_threads_only_while_its_side_holds_the_lease(ray_session):
    own = torch.get_num_threads()
    lease = CoreLease.remote()
    try:
        threads = LeasedThreads(lease, TRAINER, lent=2)
        assert threads.adjust() == own == torch.get_num_threads()  # nobody holds it yet
        ray.get(lease.set.remote(TRAINER))
        assert threads.adjust() == own + 2 == torch.get_num_threads()
        ray.get(lease.set.remote(GENERATOR))
        assert threads.adjust() == own == torch.get_num_threads()
        ray.get(lease.set.remote(None))
        assert LeasedThreads(lease, GENERATOR, lent=1).adjust() == own
    finally:
        torch.set_num_threads(own)
        ray.kill(lease)


def test_the_lenders_threads_are_shared_evenly_among_the_borrowers():
    assert lent_threads(borrowers=1, lenders=1, lender_threads=1) == 1
    assert lent_threads(borrowers=1, lenders=2, lender_threads=4) == 8
    assert lent_threads(borrowers=2, lenders=1, lender_threads=3) == 1  # 3 threads over 2, rounded down
    assert lent_threads(borrowers=4, lenders=1, lender_threads=2) == 0
