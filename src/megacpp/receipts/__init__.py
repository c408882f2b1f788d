"""megacpp.receipts"""
