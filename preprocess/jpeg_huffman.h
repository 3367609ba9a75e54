#pragma once
// Our Huffman decoder for baseline JPEG scans, put into a libjpeg-turbo decompression in place of
// its own.
//
// About 70% of a DCT-scaled decode of a large photo is Huffman decoding (perf, on the preprocess
// bench). libjpeg-turbo's decoder refills its bit buffer one byte at a time, testing each byte for
// a marker, and takes its slow path for the whole of any file with restart markers. This one
// removes the byte stuffing ahead of the reader into a small window, so that a refill is one
// unaligned 64-bit load, and one table lookup gives most coefficients together with their value
// bits. It produces exactly libjpeg's coefficients into libjpeg's MCU buffers, so the inverse DCT,
// upsampling and colour conversion downstream stay libjpeg's and the pixels do not change.

struct jpeg_decompress_struct;

namespace lorapipe::preprocess {

// Puts the decoder into `info`, between jpeg_start_decompress and the first jpeg_read_scanlines,
// when the image is a single interleaved baseline Huffman scan (the common camera and encoder
// output) and the data source holds the rest of the file in memory (jpeg_mem_src). Returns false,
// leaving libjpeg's decoder in place, for anything else (progressive, arithmetic coding, several
// scans). On corrupt data it raises a libjpeg error through error_exit where libjpeg would only
// warn and pad the block with grey: its caller declines such a file.
bool install_fast_huffman(jpeg_decompress_struct* info);

}  // namespace lorapipe::preprocess
