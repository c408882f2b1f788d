"""megacpp.data"""
