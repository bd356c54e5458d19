"""Paging training state — parameters, gradients, optimizer states — through the user's own
training loop: module hooks (model.py), the streamed optimizer step (optimizer.py), streamed
gradient clipping (clip.py), the page-fault handler (fault.py), tied together by session.py."""
