"""megacpp.pattern"""
