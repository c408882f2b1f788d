"""megacpp.train"""
