"""Backends plug in behind the protocol in ``base``; see ``registry``."""
