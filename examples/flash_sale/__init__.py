"""Flash sale: one-time form tokens, no oversold stock, a payment call made once."""
