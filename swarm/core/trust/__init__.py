"""Which claims are believed: members' credentials, their signed entries and votes, and the commit rule."""
