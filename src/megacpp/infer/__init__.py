"""megacpp.infer"""
