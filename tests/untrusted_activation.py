"""Named by checkpoints in the untrusted-path tests: importing it at all is the failure being tested."""
raise RuntimeError("tests.untrusted_activation was imported although trust_remote_code=False")
