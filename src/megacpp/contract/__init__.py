"""megacpp.contract"""
