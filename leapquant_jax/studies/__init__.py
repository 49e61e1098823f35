"""Studies: small, reproducible experiments behind the method's claims (``leapquant study ...``)."""
