"""Reads stream entries written as CloudEvents (binary content mode, the Kafka binding's field
names) and parses each with the CloudEvents SDK for Python, which checks the attributes as it
builds the event. One JSON object per line in, {"entry", "fields"}; one per line out, {"entry",
"attributes", "data"} with `time` as microseconds since the Unix epoch, or {"entry", "error"}."""

import datetime
import json
import sys

from cloudevents.core.bindings.kafka import KafkaMessage, from_binary_event

EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)

for line in sys.stdin:
    item = json.loads(line)
    fields = item["fields"]
    try:
        message = KafkaMessage(
            headers={name: value.encode() for name, value in fields.items() if name != "data"},
            key=None,
            value=fields["data"].encode(),
        )
        event = from_binary_event(message)
        attributes = dict(event.get_attributes())
        attributes["time"] = (attributes["time"] - EPOCH) // datetime.timedelta(microseconds=1)
        out = {"entry": item["entry"], "attributes": attributes, "data": event.get_data()}
    except Exception as error:  # the test reports what the SDK refused
        out = {"entry": item["entry"], "error": f"{type(error).__name__}: {error}"}
    print(json.dumps(out))
