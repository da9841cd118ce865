"""Ops the packed models share: layout conversions, attention, first-token attention, fused linears."""
