"""The contract: hookspec on its own, validation of every input, value checks, the fuzzer."""
