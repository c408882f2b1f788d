"""megacpp.model"""
