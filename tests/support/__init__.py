"""Test support: the helpers, truths and plugins the test modules share (no tests here).

Imported as ``tests.support.<module>``; the library never imports it.
"""
