"""The recovery drill: a receipt-model run under a budget, interrupted at awkward points."""
