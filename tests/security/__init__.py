"""The standing adversarial suite: real pdserve processes on loopback, attacked in bounded ways.

Each module builds its own stack (scheduler, prefill, decode, gateway) with tests/support's harnesses, on the tiny
dense checkpoint (dense_checkpoint) and the KV key (kv_key_file) of tests/support/fixtures.py.
"""
