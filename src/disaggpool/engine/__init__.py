"""The engine model of one vLLM prefill or decode instance, advanced analytically (pure).

The simulator runs it on simulated time (`sim.cluster`), the emulator on the asyncio clock
(`emulator.engine_driver`); both call only its public operations.
"""
