#!/usr/bin/env python3
"""Reads what trainer/tensorboard.cpp writes with the Python tensorboard package's own code, for
trainer/tensorboard_test.cpp. Prints one JSON object on stdout.

  read_tensorboard.py crc32c HEX...   tensorboard's crc32c and masked_crc32c of each hex string
  read_tensorboard.py read FILE       the events file as TensorBoard sees it:
    records    records that pass the CRC checks, read with the TFRecord reader TensorBoard uses
               when TensorFlow is absent (compat.tensorflow_stub PyRecordReader_New)
    data_loss  the DataLossError that reader raised (a failed CRC, a truncated record), or null
    file_version, scalars
               from EventFileLoader, the loader TensorBoard's server reads runs with (it applies
               data_compat, so a simple_value arrives as a float32 scalar tensor of the
               "scalars" plugin). It stops quietly at the first record that fails its CRC.
"""
import json
import math
import struct
import sys

from tensorboard.backend.event_processing import event_file_loader
from tensorboard.compat.tensorflow_stub import errors
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
from tensorboard.util import tensor_util


def crc(hex_strings):
    out = []
    for text in hex_strings:
        data = bytes.fromhex(text)
        out.append({
            "crc32c": pywrap_tensorflow.crc32c(data),
            "masked": pywrap_tensorflow.masked_crc32c(data),
        })
    return {"checksums": out}


def strict_records(path):
    reader = pywrap_tensorflow.PyRecordReader_New(path)
    count = 0
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return count, None
        except errors.DataLossError as e:
            return count, e.message
        count += 1


def read(path):
    records, data_loss = strict_records(path)
    file_version = None
    scalars = []
    plugins = {}
    for event in event_file_loader.EventFileLoader(path).Load():
        if event.HasField("file_version"):
            file_version = event.file_version
        for value in event.summary.value:
            if value.metadata.plugin_data.plugin_name:
                plugins.setdefault(value.tag, value.metadata.plugin_data.plugin_name)
            array = tensor_util.make_ndarray(value.tensor)
            number = float(array)
            scalars.append({
                "tag": value.tag,
                "step": event.step,
                "wall_time": event.wall_time,
                "dtype": str(array.dtype),
                "shape": list(array.shape),
                "bits": struct.unpack("<I", array.astype("<f4").tobytes())[0],
                "value": number if math.isfinite(number) else repr(number),
            })
    return {
        "records": records,
        "data_loss": data_loss,
        "file_version": file_version,
        "scalars": scalars,
        "plugins": plugins,
    }


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "crc32c":
        result = crc(sys.argv[2:])
    elif len(sys.argv) == 3 and sys.argv[1] == "read":
        result = read(sys.argv[2])
    else:
        sys.exit(__doc__)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
