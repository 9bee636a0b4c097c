"""Layer 3, engine: ``segments`` (Piece/Fill/Cast: what an output byte range is made of, plain data),
``executor`` (one chunker, one worker, one copy loop), ``torchzip`` (torch zip files planned as segments and
written through the executor), ``checked`` (the CRC-32 check of every input byte read), ``launch`` (a launcher's
job as one group of ranks) and ``distributed`` (any plan split across those ranks by bytes)."""
