"""Compiled selective scan (C contract: scan.pxd; hot loops: csrc/mx_scan.h)."""
