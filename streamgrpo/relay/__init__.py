"""The relay: one copy of each weight version per host, re-published to the host's generators."""
