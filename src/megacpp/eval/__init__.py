"""megacpp.eval"""
